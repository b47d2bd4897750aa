"""The pool service: one paged KV pool (target layers and the drafter's spec layers), its block
manager and prefix cache, its memory and the handle others map it by, and the gRPC control plane.

Others meet it through `PoolHandle` (map the pages) and `PoolControl` (the block-table verbs);
`kvpool_service.assembler.build_pool` builds one. See docs/architecture.md sections 3, 5 and 6.
"""
