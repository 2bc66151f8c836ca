"""tidal's Grafana dashboards: Python source (dashboards.py) and the JSON it generates."""
