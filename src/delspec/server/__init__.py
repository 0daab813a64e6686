"""An OpenAI-compatible HTTP server for one model, decoding with DEL (or any strategy).

Requests are validated and tokenised on the event loop, then wait in a bounded queue for the
single worker thread that runs `generate` one sequence at a time. A full queue answers 429; a
request that waits in the queue too long answers 503, one whose generation runs past the request
timeout answers 504 (streams get an error event instead); a client that goes away, a timeout,
or a shutdown stops its generation at the next round. Every error is an OpenAI error object.
"""

from delspec.server.app import create_app, serve

__all__ = ["create_app", "serve"]
