"""Serving past one process: engine replicas behind one OpenAI API.

    event_feed.py   a replica's KV events as numbered reports; a router's index of them
    ray_router.py   the Ray Serve request router: longest hybrid hit, balanced against queues
    ray.py          the Ray Serve application (`hybridkv serve --replicas N`)
    processes.py    processes below others, ended when a server stops (nothing left behind)

ray_router.py and ray.py need the `ray` extra (`pip install -e ".[ray]"`);
event_feed.py and processes.py are torch-free and Ray-free.
"""
