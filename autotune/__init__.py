"""Autotuning of the fused kernels' launch parameters (num_warps, num_stages).

    space.py     the config space per kernel and the rules that prune it
    registry.py  tunable kernels (compress, decompress, reduce): name -> how to build a timed problem
    cache.py     the cache key (size enters as a power-of-4 bucket), the JSON format, safe I/O
    runtime.py   lookup() called by taco_triton.kernels._launch: shipped files, the user's cache,
                 online tuning (TACO_AUTOTUNE=online), agreement across torch.distributed ranks
    sweep.py     python -m autotune.sweep: time the space over a grid, CSV + cache
    show.py      python -m autotune.show: print a cache as a table
    tuned/       shipped per-GPU files (<normalised gpu name>.json), produced by the sweep on a GPU

Environment: TACO_AUTOTUNE = cached (default) | online | off; TACO_AUTOTUNE_CACHE = the user's
cache file (default ~/.cache/taco_triton/autotune.json). Importing any of this makes no CUDA call.
"""
