"""vLLM, and what is measured through it: the configuration matrix as data (`matrix`), one engine per child process
(`child`, run by the engine's own interpreter), each environment's vLLM in its own venv (`venvs`, and its wheels for a
host without internet: `wheelhouse`), the runner that checks a matrix and runs it, writing one record per
configuration (`runner`, `matrix_run`, `plan`, `checks`), and the measurements made through `vllm serve` or
`vllm.LLM`: the tie-stop survey and its injected truncations (`survey`), the guard on a server (`guard_measure`),
under load (`guard_load`) and the server probe (`serve_probe`), each server started the same way (`serve`). Kept
light: the child imports this package inside the engine's interpreter."""
