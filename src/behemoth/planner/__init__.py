"""The planner: pure cost formulas (compute, memory, communication per axis) and the search
over plans that uses them. Nothing here opens a process group.

=====================  ==================================================================
module                 what it holds
=====================  ==================================================================
``collectives``        a collective's ring bytes per rank; ``Traffic`` (forward, backward)
``traffic``            tensor-parallel bytes per mode: ``tp1d_traffic``, ``tp2d_traffic``
                       (2D, 2.5D), ``tp3d_traffic``; context parallelism's in
                       ``context_traffic``
``params``             what one rank holds: its stage's blocks, its parameters (exact per
                       tensor-parallel layout)
``axis_traffic``       bytes per mesh axis of one step of a plan (what the ledger counts)
``memory``             the ZeRO chunk / offload memory plan (``behemoth plan --memory``)
``workload``           a model's shape, sequence and global batch; exact parameter counts
``calibration``        a machine's rates (JSON; shipped ``calibrations/h100.json``,
                       ``h200.json``, estimated from datasheets)
``cluster``            GPUs, nodes, memory, and the link class each axis's groups cross
``compute``            a roofline per GEMM shape as each tensor-parallel mode splits it
``footprint``          memory per GPU and host of a plan (``plan_memory``: over its
                       pipeline stages, the reserve included)
``grad_buckets``       the gradient sync's axes: the parameters a rank reduces over each,
                       in how many buckets or chunks
``moe_bytes``          what an MoE layer's routing, dispatch and combine keep and move
``bubble``             pipeline makespan and peak in-flight micro-batches (the simulator)
``cost``               ``predict(plan, workload, cluster)``: step time and memory
``search``             ``search(workload, cluster, limits)``: every legal plan, ranked
``auto``               ``auto_plan(model, world)``: the search's winner (``plan="auto"``)
``report``             the table, ``explain``, a Chrome trace
``scale``              64-1,024 GPU sweeps: where 2D / 2.5D / 3D overtake 1D
``host``               the host's issue time per block (kernels and collective calls);
                       ``expert_kernels``: an MoE layer's kernels by route
``generation_bytes``   generation's collectives per axis (prefill, a decode step) and its
                       memory per rank (weights, KV cache, activations)
``generation``         generation's time per layout, the largest batch x context that fits,
                       the 1D-against-2D sweep (``behemoth plan --generate``)
=====================  ==================================================================
"""
