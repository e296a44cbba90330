"""JSON Schema, enforce or refuse: `support` names the first keyword xgrammar would not enforce, `rewrite`
turns a schema into an equivalent one xgrammar enforces (with `anchors`, `formats`, `negation`,
`property_names`, `siblings`, `conjoin`, `literals`, `regex`), and `presence` adds the exact rewrites
llguidance needs (with `one_of`, `conditional`). Every walk goes through `walk`'s one keyword table.
Plain Python and jsonschema only: no torch, no grammar backend.
"""
