"""A fleet of kvpage replicas: where every replica's KV blocks are (index.py), which replica takes a
request (routing.py), and the Ray Serve application that runs them (ray_app.py, imported only when
Ray is). index.py and routing.py are torch-free and Ray-free: the fleet simulation runs them as is."""
