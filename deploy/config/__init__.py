"""The deployment YAML, by concept: `schema` (the keys as one frozen, validated DeployConfig),
`load` (a file to that schema, with ConfigError naming the file and each bad key), `files` (the
certificates, keys and secrets the YAML names, read once at load), `ray_keys` (the Ray placement
keys' validators), and `checks` (the offline checks of a config against a model, run before
anything starts). A config is loaded once at the start of `pdserve up` or `pdserve tune` and only
read after that; importers name the module that owns what they use.
"""
