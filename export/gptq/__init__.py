"""GPTQ rounding shared by the CPU and HTP targets: rounding.py (numpy), calibrated.py (a float source's
projections onto 4-bit block grids, Hessians from the recorded calibration traces)."""
