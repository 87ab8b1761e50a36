"""Chapter 10: the load tester, ``minserve bench serve``.

A client that talks HTTP to any OpenAI-compatible server (minserve, vLLM, SGLang) and measures what a user
would feel. One idea per module:

* :mod:`~minserve.bench.workload` – what to send: prompt and output lengths, shared prefixes, cancellations;
* :mod:`~minserve.bench.arrivals` – when to send it: open-loop timetables (Poisson, gamma, constant) or a
  closed loop at fixed concurrency;
* :mod:`~minserve.bench.client` – one streaming request, timed chunk by chunk;
* :mod:`~minserve.bench.runner` – a workload on an arrival process, and sweeps over rates or concurrencies;
* :mod:`~minserve.bench.metrics` – vLLM's benchmark definitions on top of :mod:`minserve.slo`;
* :mod:`~minserve.bench.report` – records.jsonl, summary.json and the printed table.
* :mod:`~minserve.bench.overload` – chapter 09's experiments: overload at multiples of capacity, every
  request accounted for, and the retry storm.

It never imports the engine or the server: it must measure a server it does not share a process with.
"""
