"""Deployment files (docker-compose's nginx and Prometheus configs) and their loopback runner."""
