"""Controllers over the cluster, each a loop beside the request path.

`role_manager` moves `both` workers between prefill and decode (one replica decides, holding a
lease); `scaling` turns the live signals into the autoscaling recommendation.
"""
