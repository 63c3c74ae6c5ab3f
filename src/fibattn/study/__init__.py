"""The study: experiment grids and their runner, the report and its figures, the retrieval
probe, the demo, and the published numbers a reproduction is held against."""
