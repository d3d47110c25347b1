"""llama-server's router mode: several models of a ``--models-preset`` file served by name, each
by its own ``pyllama-spec serve`` process.

``pyllama-spec serve --models-preset FILE`` without a model (no ``-m``) becomes a router, as
llama-server does (tools/server/server-models.cpp of the pin). The router loads no model itself:

- each preset section is a model, named by the section (its ``alias`` key adds other names);
  a model is loaded by starting a child ``pyllama-spec serve`` with the section's arguments on a
  free port of 127.0.0.1, when a request names it (unless ``--no-models-autoload`` or
  ``?autoload=false``), on ``POST /models/load``, or at start (``load-on-startup = true``);
- at most ``--models-max`` children run at once (4; 0: no limit): a request for one more model
  waits while the least recently used idle model is stopped (llama-server's eviction rule: a
  model answering a request, still loading, or wanted by a waiting request is never chosen);
- a request is proxied to its model's child (``model`` of the JSON body for POST, ``?model=``
  for GET), streamed answers passed on as they arrive; a client that goes away closes the
  connection to the child, which stops the generation;
- a model is stopped with SIGTERM (the child cancels its generations and exits) and killed
  after its ``stop-timeout`` (10 s); one still loading is killed at once;
- a child that crashes or fails to start leaves its model ``unloaded`` with ``failed: true``,
  its ``exit_code`` and the last lines it wrote (``reason``, this server's addition); the other
  models keep working, and the next request for it starts it again (llama-server's rule);
- the router checks the API key; each child takes a random key of its own that only the router
  knows, and listens on 127.0.0.1 only. A child whose router dies (its stdin closes) exits.

- ``GET /models?reload=1`` reads the preset file again, as llama-server does: a model gone from
  it disappears (stopped first if it runs), a running one whose section changed is stopped, an
  unchanged one keeps running, a new one is listed unloaded; a file that cannot be served is a
  500 and the models stay as they were. A request for a model waits while a reload stops models.

Routes: ``GET /models`` and ``/v1/models`` (every model with its status), ``POST /models/load``,
``POST /models/unload``, ``GET /models/sse`` (status events), ``/health``, ``GET /props`` (the
router's, or a model's with ``?model=``) and llama-server's model routes, proxied.

The modules: ``pool`` (the models and their states: which run, evicting, waiting for one, the
status events; ``follow_router`` on the child's side), ``child`` (one model's process: its
command line, started, followed, stopped, killed), ``proxy`` (a request passed to its model's
process and the answer passed back; the status events' stream) and ``app`` (the routes:
``create_router_app``).
"""
