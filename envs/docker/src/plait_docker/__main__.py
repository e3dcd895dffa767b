from plait_docker.cli import main

main()
