"""The book: what the notebooks call, and nothing below imports.

- one module per chapter, its computations, tables and sentences: `incident`, `reproduce` (with `tensor_parallel`,
  one device beside a split engine), `guidance`, `summary` (the first page, with its `findings`,
  `release_findings` and `claims`: sentences over runs as data, checked against every record);
- a chapter's glue values, kept apart from the code a measurement's key hashes: `reproduce_page`, `margins_page`,
  `reduction_order_page`, `guard_load_page`, `diagnose_page`, `guidance_classifier`, `guidance_survey`,
  `guidance_rows`;
- `diagnose`: `make diagnose`, one request's chapter; `timings`: the execution appendix's build times;
- `plots` and `pages` (a page's figures and long tables as HTML); `run`: executing the stale chapters.
"""
