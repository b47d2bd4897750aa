"""Training: a small Qwen3 target from scratch, and a DFlash drafter for a Qwen3 target.

Rooms: `corpus` (the standard-library corpus, its hash split, the byte-level BPE tokenizer),
`dense_target` (a trainable Qwen3 forward whose parameter names ARE the HF names), `dense_drafter`
(the DFlash training forward whose names are the DFlash layout's), `anchors` (anchor sampling, the
block mask and the loss weights), `optim` (AdamW, warmup + cosine), `loop` (the shared step loop),
`progress`, `state` (checkpoints and resume), `export` (the on-disk layouts), `drafter_data`
(target continuations through the engine, raw windows), `evaluate` (acceptance and speed through
the engine, beside prompt lookup, the n-gram baseline), `train_target` / `train_drafter` (the two
`dflash train` commands). It sits beside the services and imports them (both models and the
engine); no service imports it.
"""
