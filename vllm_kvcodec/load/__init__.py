"""The load path: fetch -> decode -> scatter into paged memory, layer group by layer group, with per-layer readiness."""
