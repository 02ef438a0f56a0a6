"""The stages of ``scripts/gpu_check.py`` (the prepared GPU run), one module per concern.

    checks.py     the correctness stages: env, ops, attention, exactness, precision, long_context, drafter
    shapes.py     model widths, batches, the memory plan (layers cut to fit) and each method's FLOPs
    methods.py    dense, keep, replay, packed and Prefix Grouper on one batch, built outside the clock
    measure.py    CUDA-event timing (methods alternating call by call), gradient check, profiler analysis
    training.py   the training stages (one per shape): setup, warm-up, timed rounds, profile, table
    trl_stage.py  stock ``trl.GRPOTrainer`` against forkrl ``tree_packing`` on the device
    wheels.py     the carried wheels (scripts/gpu_wheels.sh) put on ``sys.path``

``gpu_check.py`` puts ``scripts/`` on ``sys.path`` and imports this folder as the package ``gpu``.
"""
