"""The book's layer: one module per chapter (its computations, tables and sentences), the chapters' glue values
(`*_page`, `guidance_*`), the first page's findings and claims, figures and a page's HTML. The notebooks call these;
nothing below the book imports them."""
