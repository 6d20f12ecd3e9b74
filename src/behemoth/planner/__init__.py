"""The planner: pure cost formulas (compute, memory, communication per axis) and the search
over plans that uses them. Nothing here opens a process group."""
