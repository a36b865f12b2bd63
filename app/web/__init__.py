"""The web app: server-rendered page shells whose scripts read the same /v1 API as every client.

The shells are Jinja templates (autoescaped) with plain scripts, served by the API process itself
(same origin, no CDN).
"""
