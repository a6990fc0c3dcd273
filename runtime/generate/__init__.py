"""The one generation loop and its bookkeeping: requests, the row scheduler, the prompt cache, sampling, each
choice's text, and the callers that drive the loop."""
