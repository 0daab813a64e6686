"""An OpenAI-compatible HTTP server for one model, decoding with DEL (or any strategy).

Requests are validated and tokenised on the event loop, then wait in a bounded queue for the
worker thread, which generates for up to `max_batch` of them at once (continuous batching, one
KV cache slot each; see `delspec.server.worker`). A full queue answers 429; a
request that waits in the queue too long answers 503, one whose generation runs past the request
timeout answers 504 (streams get an error event instead); a client that goes away, a timeout,
or a shutdown stops its generation at the next round. Every error is an OpenAI error object.
"""

from delspec.server.app import create_app
from delspec.server.runner import serve, serving

__all__ = ["create_app", "serve", "serving"]
