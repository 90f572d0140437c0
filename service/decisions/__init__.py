"""Pure decisions (no Ray, no torch, no I/O): the supervisor's state machine, the job policy it runs by,
stragglers, resize policy, queue admission, goodput. Each is a function of plain values, tested one case
at a time.
"""
