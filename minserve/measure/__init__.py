"""Experiments on the engine: the one layer that runs it and reads what it did, between the engine and the
chapters' helpers.

* :mod:`.steps`: :class:`~.steps.StepRecorder`, the engine core's step reports for the length of a block, and
  what a decode step's time is read as (whole step, executor, end to end);
* :mod:`.decode`: what a decode step costs by batch size (chapter 01), one prefill and pure decode steps at a
  context (the profiler's measuring half);
* :mod:`.arrivals`: requests served as they arrive, on the clock or by step count (chapters 05 and 09,
  calibration, the simulator's validation);
* :mod:`.prompts`: seeded random prompts.

It imports the engine and nothing above it; :mod:`minserve.capacity` (the profiler's predictions, the cost
model's fit, the simulator) and :mod:`minserve.lab` (figures, tables, widgets, check cells) build on it, and
``benchmarks/`` are command lines over it. Each module is imported on its own.
"""
