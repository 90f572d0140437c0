"""The rank process: the Ray actor per rank and the warm spares, its log, its reports to the supervisor, the
step-boundary control (saves and stops every rank follows), and the chaos drills run on a rank.
"""
