"""The HTTP edge: what a client or an operator talks to.

The aiohttp application and its routes (`app`), the server with its client bounds (`server`),
the command line (`serve_cli`, `dropin`), the admin API (`admin`), API keys (`auth`), the one
front door every route enters (`front_door`), the drain on SIGTERM (`shutdown`) and the routes
served whole by one worker (`passthrough`). Nothing in the router imports this room.
"""
