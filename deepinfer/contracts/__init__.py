"""The plain-data contracts every layer shares: the step plan and model output (`plan`), the cache
group specs and row descriptions (`cache`), and what a model and a runner offer (`model`).

Nothing here imports torch or any of our modules above `config`: the engine, the worker and the
model executor all import from this floor, never from each other upwards.
"""
