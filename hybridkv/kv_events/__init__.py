"""KV events past the process: vLLM's wire format, a ZMQ stream of it, and
the numbered reports and prefix index a router keeps (torch-free).

    wire.py         the engine's events in vLLM's KV event format (msgspec)
    zmq_stream.py   a publisher with replay in vLLM's protocol, and a subscriber
    feed.py         a replica's events as numbered reports; a router's index of them

Below both the server (which publishes) and the Ray app (which routes by
them); wire.py needs msgspec and zmq_stream.py pyzmq (the `server` extra).
"""
