"""`rdlm serve`, the OpenAI-compatible server: the app, its endpoints and metrics (`app`), the worker thread
that runs the engine (`worker`), the HTTP guard in front of it (`http_guard`), the request and response
schema (`openai_api`). The top of rdlm.inference: nothing here imports it."""
