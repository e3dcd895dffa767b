"""Training building blocks shared by the torch-based trainer engines (plait-torch, plait-fsdp2,
...).

Everything here imports torch, so nothing in `plait` imports this package: `import plait` and
plugin discovery stay torch-free. A trainer plugin imports the modules it uses:

- `plait_train.layout`: a call's data as micro-batches of rows: padded, packed (several
  sequences per row, no attention across them) or prefix-shared (a token tree per row).
- `plait_train.scorer`: a Hugging Face causal LM as a module that returns target logprobs at
  selected positions, with the chunked output head where the model allows it.
- `plait_train.step`: forward / forward_backward over micro-batches with a plait loss.
- `plait_train.checkpointing`: activation checkpointing (full or selective) on decoder layers.
- `plait_train.ops`, `plait_train.perf`: the chunked output head; FLOPs and peak FLOP/s.
- `plait_train.state`: RNG state and atomic checkpoint directories.
- `plait_train.engine`, `plait_train.optimizer`: the framework-independent half of a
  single-process trainer engine (forward/backward calls, AdamW steps, saved states), shared by
  plait-torch and plait-megatron.
"""
