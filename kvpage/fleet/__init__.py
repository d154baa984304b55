"""A fleet of kvpage replicas: where every replica's KV blocks are (index.py), which replica takes a
request (routing.py), and the Ray Serve application that runs them (ray_app.py: FleetSpec and Fleet;
index_actor, ray_routing, publisher, replica, ingress, fleet_metrics, fleet_feed; imported only when
Ray is). index.py, routing.py and metric_families.py are torch-free and Ray-free: the fleet simulation
runs the first two as is."""
