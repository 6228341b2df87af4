"""The HTTP API: the serving layer's answers over HTTP (``lambdalake serve``). It sits on top, beside the
CLI, and calls the layers; nothing below imports it."""
