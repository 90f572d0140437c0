"""Pure planning (no Ray, no torch): the job spec, its bounds, and the planner's memory, bubble and
throughput model that says why a layout does or does not fit.
"""
