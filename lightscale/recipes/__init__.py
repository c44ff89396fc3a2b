"""Reference recipes (model + data + LightningModule) that the strategies are exercised on."""
