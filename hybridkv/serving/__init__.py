"""Serving past one process: engine replicas behind one OpenAI API.

    ray_router.py   the Ray Serve request router: longest hybrid hit, balanced against queues
    ray.py          the Ray Serve application (`hybridkv serve --replicas N`)
    processes.py    processes below others, ended when a server stops (nothing left behind)

ray_router.py and ray.py need the `ray` extra (`pip install -e ".[ray]"`);
processes.py is torch-free and Ray-free; the KV event feed the router
reads is kv_events/feed.py.
"""
