"""The job protocol and store: what the notebook side and the instance agree on.

A job is a ``spec``; its durable state lives in a ``store`` under the keys of
``layout``; one agent at a time works on it (``lease``); what happened is its event log
(``events/``, folded into one ``JobState``). Also the shared services both sides use:
retries (``backoff``), the cost of spotnb's own requests (``usage``), a job's secrets
(``secretstore``) and webhook notifications (``notify``). Imports nothing of either
side.
"""
