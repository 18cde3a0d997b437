"""Kubernetes: the sidecar injected beside Envoy in gateway pods, by webhook or by `inject`.

`patch` turns a pod's ``ratelimit-sidecar/*`` annotations into the sidecar container and the
JSON Patch that adds it (pure); `webhook` answers AdmissionReview v1 over HTTPS; `manifests`
injects YAML files; `commands` adds the `webhook` and `inject` subcommands to the CLI.
"""
