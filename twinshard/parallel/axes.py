"""The mesh axes' names in mesh order, outermost first (twinshard/parallel/mesh.py says why)."""

ORDER = ("stage", "data", "expert", "context", "tensor")
