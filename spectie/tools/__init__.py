"""The operator's tools, which decide from what vLLM returned: the tie-stop detector (`tiestop`) and its threshold
(`thresholds`), the divergence classifier (`divergence*`), the guard in front of `vllm serve` (`guard`,
`guard_proxy`) and the fix ledger (`fixes`). They import the record store and the lab; no vLLM inside (the engines
record the detector's reading, so they sit above)."""
