"""The mesh axes' names in mesh order, outermost first (twinshard/parallel/mesh.py says why).

`fsdp` is hsdp's axis inside a slice (its weights' shards); `data` is then the axis across slices."""

ORDER = ("stage", "data", "fsdp", "expert", "context", "tensor")
