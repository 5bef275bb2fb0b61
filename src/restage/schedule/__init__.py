"""The contract between the planner and the runtime: op kinds, the program builder, the schedule file, reallocation plans.

``restage.plan`` builds schedules and ``restage.runtime`` executes them; both import this package and
neither imports the other (docs/DESIGN.md).
"""
