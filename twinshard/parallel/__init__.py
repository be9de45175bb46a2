"""Parallel plumbing: the strategy declarations, meshes, placement (tables -> shardings), and the
pipeline and context-parallel layouts."""
