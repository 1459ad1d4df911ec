"""vLLM engines: the configuration matrix as data (`matrix`), one engine per child process (`child`, run by
the engine's own interpreter), each environment's vLLM in its own venv (`venvs`), and the runner that
checks a matrix and runs it, writing one record per configuration (`runner`). Kept light: the child
imports this package inside the engine's interpreter."""
