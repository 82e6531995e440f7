"""The reference parallel trainer (torch TP + PP + DP); it reads and writes the common format only.

Read it in this order, one job per file:

    model.py       GPT2/Llama decoder cut into pipeline stages; a token from embedding to loss
    tp.py          column/row-parallel linears, vocab-parallel embedding and cross entropy
    grid.py        which tp/pp/dp rank a process is, and its process groups
    pipeline.py    the 1F1B schedule: micro-batches, send/recv between stages
    optim.py       AdamW, warmup + cosine/linear decay, global-norm clipping (shared by every framework)
    data.py        synthetic or tokenized batches, identical at every layout
    checkpoint.py  load/save in the common format, atomically; resume from the newest complete step
    train.py       checks a run (`prepare`), then the loop every rank runs (`run`)
    launch.py      `train(cfg)`: spawn the ranks, or join torchrun
    config.py      TrainConfig from a MindSpeed-Core-MS YAML or a Megatron args file
    init.py        a fresh random checkpoint for a ModelSpec
    lora.py        LoRA on a frozen base: adapted linears split like their weights, a fresh adapter

Python API: `interop.trainer.launch.train(TrainConfig(...))`.  Parity against other layouts and
frameworks, which needs the converters, is `interop.workflows.parity`.  Ranks are separate
processes, so a script calling them needs the usual `if __name__ == "__main__":` guard.
"""
