"""The client-facing router: PDServe API, worker pool, orchestration of Reserve -> Prefill -> Stream."""
