from kvbench.harness.cli import main

main()
