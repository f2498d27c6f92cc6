"""What this machine is and has, asked once and cached: where the engine keeps its files, which CPU
dtype computes fastest. Below the config (which resolves "auto" values with it) and above nothing
but the errors."""
