"""Building blocks of the models: parallel linears, norms, rotary embedding, vocab layers."""
