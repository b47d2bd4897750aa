"""The drafter service: the DFlash draft model, its context storage (paged in the pool, or dense),
the step buffers it shares with the target, and `DraftWorker`, which implements `DraftControl`.

`drafter_service.assembler.DrafterAssembler` builds the worker from a `PoolHandle`, the step buffers'
handle and the two checkpoints. See docs/architecture.md sections 3 and 7.
"""
