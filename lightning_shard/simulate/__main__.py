from lightning_shard.simulate.command import main

main()
