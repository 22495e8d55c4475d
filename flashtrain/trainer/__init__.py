"""The GPT trainer, configured by Hydra (``conf/``, installed as ``flashtrain.conf``): ``model`` (the GPT),
``backends`` (the ``attn=`` choices), ``module`` (the LightningModule), ``data`` (the LightningDataModule),
``callbacks`` (throughput, MFU, memory), ``config`` (resolvers such as ``seq_len=16k``), ``train`` (build and fit)
and ``cli`` (the ``flashtrain-train`` command)."""
