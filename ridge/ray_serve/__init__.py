"""ridge on Ray Serve: engine replicas, a prefix-aware request router and ridge's OpenAI app as the
ingress (ridge.ray_serve.app). Imported only when asked for (`ridge serve --ray`, `serve run`):
nothing else in ridge imports Ray."""
