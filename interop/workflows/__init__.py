"""Workflows: what needs both the converters and the trainer, on top of both (only the CLI imports it).

    verify.py             a fixed batch through two checkpoints, in the reference model and their frameworks
    parity.py             the same run at several layouts and in other frameworks, compared and plotted
    frameworks.py         HF transformers and MindSpore running that same run
    megatron_framework.py megatron-core running it, when installed
    mindspore_model.py    the decoder in MindSpore ops over a MindSpore checkpoint, by its dialect's name table
    model_facts.py        a model's facts by name, for the forwards above that compute only some of them
    metrics.py            a run's logged losses read back, two runs' curves compared
    demo.py               the README demo, end to end

Python API: `interop.workflows.verify.verify(src, dst)` and
`interop.workflows.parity.parity(ckpt, cfg, layouts, frameworks)`.
"""
