"""Native OFA: the reference architecture (parity with OFA-Sys) and its UnifiedModel wrapper."""
